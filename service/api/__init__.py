"""Thin Litestar controllers over the request service."""
