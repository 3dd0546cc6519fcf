"""Global dispatcher: OpenAI-compatible HTTP API routing with GoRouting.
Filled in by the dispatcher issue."""
