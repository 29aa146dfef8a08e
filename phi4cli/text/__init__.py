"""The pure text leaves, shared by the daemon and the client: ``reasoning`` (the thinking
splitter, answers and votes), ``thinking`` (the thinking policy both engines run), ``loops``
(what a loop is), ``confidence`` (DeepConf's confidence), ``latex`` (LaTeX to Unicode) and
``sanitize`` (what a terminal may be shown). No I/O, no engine."""
