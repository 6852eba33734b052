"""lastevent: an OpenAI-compatible serving front end with event-sourced token streams."""
