"""TODO runtime"""
