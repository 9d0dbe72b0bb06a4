"""The `cpu` device: ggml's CPU kernels through ctypes (lib.py declares the library, rules.py
checks every node before a kernel sees it, device.py builds and runs the graphs)."""
