"""hotweights.adapters"""
