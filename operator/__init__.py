"""pagekube operator (kopf): reconciles LLMDeployment resources into Kubernetes objects. Imports no torch."""
