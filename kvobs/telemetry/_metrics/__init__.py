"""kvobs's Prometheus metrics: recorded per thread, exposed at scrape time through prometheus_client."""
