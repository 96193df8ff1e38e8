"""reward-supervisor: keeps a fleet of file-sharded reward workers alive over persistent SSH."""

import warnings

# cryptography 51 deprecates DSA, and asyncssh (2.24) names DSA types at import: every
# command of ours would print five warnings an operator can do nothing about. Only
# asyncssh's own modules are silenced; DSA itself is never offered by default (sshalgs.py).
warnings.filterwarnings("ignore", message="DSA is deprecated", module="asyncssh")
