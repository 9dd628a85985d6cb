"""oneCCL through its C API: the process group (:mod:`.group`) and the library's binding and sources
(:mod:`.library`)."""
