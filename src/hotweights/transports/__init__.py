"""hotweights.transports"""
