"""The engine host: claims queued requests, runs an engine, appends events."""
