"""Helpers every layer uses: nested containers of tensors (:mod:`.nested`), byte and time units
(:mod:`.units`), the files a user names (:mod:`.files`), and a graph's nodes in order
(:mod:`.ordering`)."""
