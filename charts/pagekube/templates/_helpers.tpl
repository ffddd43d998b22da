{{- define "pagekube.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pagekube.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: pagekube-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "pagekube.selectorLabels" -}}
app.kubernetes.io/name: pagekube-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pagekube.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pagekube.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The rules the operator needs in each watched namespace (or cluster-wide). */}}
{{- define "pagekube.namespacedRules" -}}
- apiGroups: [serving.pagekube.io]
  resources: [llmdeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [serving.pagekube.io]
  resources: [llmdeployments/status]
  verbs: [get, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services, configmaps, persistentvolumeclaims]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
- apiGroups: [""]
  resources: [pods]  # read-only, engine pods only (by label): is one waiting for a GPU? (rollout.strategy Auto)
  verbs: [list, watch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors, prometheusrules]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create]
{{- end -}}
