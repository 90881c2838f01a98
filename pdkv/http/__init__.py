"""The HTTP face the router and the workers share: OpenAI's wire shapes and routes, request limits, metric buckets."""
