"""Routes into training frameworks; each submodule imports its framework only when used."""
