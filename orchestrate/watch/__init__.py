"""Watch: the running job's containers, heartbeat, stalls, hangups and the end of each attempt."""
