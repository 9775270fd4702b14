"""The read-only facts of a host: nothing in this package changes a file or imports change/ or runtimes/."""
