"""`ConfigError`: bad input, told in one line (the config package's lowest module: the schema and the
optimizer registry raise it)."""


class ConfigError(ValueError):
    """Bad configuration: the message is one line, fit to print to a user as is."""

    def __init__(self, message):
        # a key or value carrying a line break must not break the one-line message
        super().__init__(str(message).replace("\r", "\\r").replace("\n", "\\n"))
