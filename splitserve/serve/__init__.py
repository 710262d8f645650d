"""splitserve/serve"""
