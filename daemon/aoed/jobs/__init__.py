"""Jobs in the daemon: the store that persists them and the manager that runs them."""
