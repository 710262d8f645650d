"""splitserve/common"""
