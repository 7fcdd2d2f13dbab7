"""The library's version (also ``shardsafe.__version__``), recorded in every manifest it writes."""

__version__ = "0.1.0"
