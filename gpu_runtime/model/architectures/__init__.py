"""The architectures tokend serves, one module each, every one registered in gpu_runtime/model/registry.py."""
