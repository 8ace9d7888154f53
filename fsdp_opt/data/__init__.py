"""TODO data"""
