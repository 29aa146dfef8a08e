"""The pure text leaves, shared by the daemon and the client: ``reasoning`` (the thinking
splitter, answers and votes), ``thinking`` (the thinking policy the daemon and remote servers
follow), ``loops`` (what a loop is), ``confidence`` (DeepConf's confidence), ``latex`` (LaTeX
to Unicode), ``sanitize`` (what a terminal may be shown), and checked answers: ``checking`` and
its ``check_*`` parts (SymPy, by kind of problem) and ``checker`` (their worker process, the one
room here with I/O)."""
