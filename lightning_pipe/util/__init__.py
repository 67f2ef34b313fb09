"""Helpers every layer uses: nested containers of tensors (:mod:`.nested`), byte and time units
(:mod:`.units`), and the files a user names (:mod:`.files`)."""
