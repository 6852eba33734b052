"""The routes: thin Litestar controllers over ``service/api``."""
