"""TODO train"""
