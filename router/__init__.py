"""The HTTP front door: OpenAI wire format, placement across replicas, and the disaggregated flow."""
