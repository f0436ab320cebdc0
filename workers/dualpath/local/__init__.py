"""The local cluster: `dualpath up` (a process supervisor) and `dualpath bench local`."""
