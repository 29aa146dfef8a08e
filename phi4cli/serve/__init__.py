"""``phi4 serve --http``: the OpenAI-compatible HTTP server (``http_api``), its access rules
(``http_access``) and the OpenAI request and response shapes (``openai_request``,
``openai_response``), over a Backend."""
