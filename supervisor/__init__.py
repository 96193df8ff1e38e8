"""reward-supervisor: keeps a fleet of file-sharded reward workers alive over persistent SSH."""
