"""HTTP fronts that record episodes: the OpenAI-compatible chat server (:mod:`.chat`) and the token server
(:mod:`.tokens`), their shared routes (:mod:`.routes`), request checks (:mod:`.checks`) and tokenizer threads
(:mod:`.threads`)."""
