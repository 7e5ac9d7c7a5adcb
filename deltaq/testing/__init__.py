"""Helpers for testing and benchmarking deltaq, shipped with it but never imported by it.

``deltaq.testing.s3``: moto's S3 server on 127.0.0.1 and a proxy that slows, drops or alters
store requests. Its tools (moto's server, boto3, httpx) come with the ``test`` extra.
"""
