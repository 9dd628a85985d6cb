"""oneCCL through its C API: the process group (:mod:`.group`), the library's ctypes binding and where libccl comes
from (:mod:`.library`), and hpcdl's pinned runtime with its assembly by ``hpcdl ccl install`` (:mod:`.install`)."""
