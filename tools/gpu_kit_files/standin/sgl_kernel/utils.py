"""``sgl_kernel.utils`` as SGLang's Triton attention backend imports it on CUDA."""


def is_arch_support_pdl() -> bool:
    """Programmatic dependent launch chains the real kernels' launches; none of them run here."""
    return False
