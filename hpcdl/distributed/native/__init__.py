"""The native pieces, each built from its source here by :mod:`.build` into the user's cache (:mod:`.cache`: the
lock, the publishing) and bound by its loader: the communication thread in C that knows no library
(:mod:`.c_comm_thread`, ``c_comm_thread.c``) and the C++ c10d Backend of the oneCCL group (:mod:`.ccl_backend`,
``ccl_backend.cpp``)."""
