"""The ground floor: helpers that import nothing of ddpipe.

    files      atomic writes (a reader or a crash never sees half a file)
    processes  whether a process lives, host-wide locks
    devices    CPU cores and instruction sets, the precision policy a training computes with
    ranks      who this process is among a job's ranks (plain data)
    exits      the stop signals, the exit code that says "resume", the exception that carries a stop
    logs       ddpipe's messages: the ``ddpipe`` logger shown on stderr at the level a command asks
"""
