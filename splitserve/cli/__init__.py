"""splitserve/cli"""
