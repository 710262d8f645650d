"""splitserve/infra"""
