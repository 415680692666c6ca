"""One module per chat format, each holding its one `ChatFormat` class (base.py); they are
registered in chat/registry.py."""
