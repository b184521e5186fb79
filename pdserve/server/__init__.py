"""The instance HTTP server: OpenAI routes, health, load and metrics around one engine."""
