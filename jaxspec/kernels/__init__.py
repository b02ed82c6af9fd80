"""Kernels beside XLA's own: the Pallas verification attention (`verify_attention`) and the CPU matmul (`cpu`)."""
