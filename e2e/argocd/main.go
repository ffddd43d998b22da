// argocd-health prints the health Argo CD would show for one live resource, computed by Argo CD's own code:
// its settings manager reads the argocd-cm ConfigMap from the cluster (resource.customizations.health.* keys),
// and gitops-engine's health check runs the matching Lua script with Argo CD's Lua VM, as the application
// controller does. Used by e2e/node/test_argocd_health.py; not part of pagekube.
//
//	argocd-health -kubeconfig K -argocd-namespace argocd -group serving.pagekube.io -version v1alpha1 \
//	  -resource llmdeployments -namespace default NAME
//
// Output: one JSON line, {"status": "...", "message": "..."} ("status" is empty when no check matches).
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"

	"github.com/argoproj/argo-cd/v3/util/lua"
	"github.com/argoproj/argo-cd/v3/util/settings"
	"github.com/argoproj/gitops-engine/pkg/health"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

func main() {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the cluster")
	argocdNamespace := flag.String("argocd-namespace", "argocd", "namespace of the argocd-cm ConfigMap")
	group := flag.String("group", "serving.pagekube.io", "API group of the resource")
	version := flag.String("version", "v1alpha1", "API version of the resource")
	resource := flag.String("resource", "llmdeployments", "plural resource name")
	namespace := flag.String("namespace", "default", "namespace of the resource")
	flag.Parse()
	if flag.NArg() != 1 {
		fail(fmt.Errorf("want one resource name, got %d arguments", flag.NArg()))
	}
	config, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		fail(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	// Argo CD's own reading of argocd-cm: only a ConfigMap labeled app.kubernetes.io/part-of=argocd counts.
	clientset := kubernetes.NewForConfigOrDie(config)
	overrides, err := settings.NewSettingsManager(ctx, clientset, *argocdNamespace).GetResourceOverrides()
	if err != nil {
		fail(err)
	}
	gvr := schema.GroupVersionResource{Group: *group, Version: *version, Resource: *resource}
	obj, err := dynamic.NewForConfigOrDie(config).Resource(gvr).Namespace(*namespace).Get(ctx, flag.Arg(0), metav1.GetOptions{})
	if err != nil {
		fail(err)
	}
	// The application controller's call: built-in checks, then the Lua overrides from argocd-cm.
	status, err := health.GetResourceHealth(obj, lua.ResourceHealthOverrides(overrides))
	if err != nil {
		fail(err)
	}
	out := map[string]string{"status": "", "message": ""}
	if status != nil {
		out["status"], out["message"] = string(status.Status), status.Message
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "argocd-health:", err)
	os.Exit(1)
}
