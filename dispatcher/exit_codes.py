"""Process exit codes shared by the supervisor, the workers and the systemd units."""

# sysexits.h EX_CONFIG: a process that cannot run on this host as configured (no GPU for a CUDA
# worker, a Triton model that does not match the spec). Restarting it cannot help, so neither
# `batchyard up` nor systemd (RestartPreventExitStatus=78) does.
EX_CONFIG = 78

# sysexits.h EX_UNAVAILABLE: a service this process needs (a Triton server) stayed unreachable
# through its start timeout. Unlike EX_CONFIG it may come back, so a restart can help.
EX_UNAVAILABLE = 69

# sysexits.h EX_USAGE: a command given an argument it cannot use (a malformed address).
EX_USAGE = 64

# sysexits.h EX_SOFTWARE: a worker the dispatcher declared hung (a batch never came back) exits
# with it from its heartbeat thread, its main thread being stuck in the model; `up` and systemd
# (Restart=always) start it again.
EX_SOFTWARE = 70
