"""hotweights.core"""
