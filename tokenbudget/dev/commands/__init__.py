"""The developer tools' commands (``broker``, ``simulate``, ``demo``), shaped as the
application's (``add_arguments``, ``main``)."""
