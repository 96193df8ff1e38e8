"""Everything that is not the supervisor but helps to see and test it.

``run`` is ``reward-supervisor demo`` (a fleet on this machine), ``sshserver`` the in-process
SSH server that plays the demo's hosts, ``worker`` the reference reward worker
(``reward-supervisor worker``, ``python -m supervisor.demo.worker``). The supervisor never
imports this package: it is the first user of the supervisor, not a part of it.
"""
