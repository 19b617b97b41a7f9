"""mlxd: a declarative serving daemon for MLX language and vision-language models."""

__version__ = "0.1.0"
