"""Everything that runs over SSH and Docker: the connections, the Docker clients, the scripts run on hosts."""
