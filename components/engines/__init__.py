"""components/engines"""
