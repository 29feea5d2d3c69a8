"""The compiled CPU kernels (csrc/, built once per machine and loaded with ctypes) and the
PyTorch-facing pieces that use them: packed linears and fused layer ops."""
