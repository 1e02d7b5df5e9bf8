"""Command line: the Typer app (`app.py`) and the torchrun launcher (`launch.py`)."""
