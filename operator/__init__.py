"""pagekube operator (kopf): LLMDeployment -> Kubernetes objects. Not built yet (issue 5); imports no torch."""
