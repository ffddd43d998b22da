"""pagekube: Kubernetes-native LLM serving (engine + operator)."""

__version__ = "0.1.0"
